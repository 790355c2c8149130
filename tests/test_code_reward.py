"""The sandbox runner and the code speed-up reward, end to end through the real process sandbox:
statuses, the exit-early guard, deterministic measurement, and the reward-hacking guards."""

from __future__ import annotations

import os

import pytest

from reward.code_speedup import judge, speedup_reward, speedup_to_reward
from reward.scorer import RewardFunctionSpec, RewardScorer
from rl.types import Sample
from sandbox.job import Job, Language, Method, Status, TestCase
from sandbox.runner import run_job

HARNESS = r"""
#include <stdio.h>
long f(long n);
int main(void) {
    long xs[64]; int k = 0; char tag[64];
    while (k < 64 && scanf("%ld", &xs[k]) == 1) k++;
    if (scanf("%63s", tag) != 1) return 3;
    for (int i = 0; i < k; i++) printf("%ld\n", f(xs[i]));
    printf("%s\n", tag);
    return 0;
}
"""
SLOW = "long f(long n) { long s = 0; for (long i = 1; i <= n; i++) s += 3 * i + 5; return s; }"
FAST = "long f(long n) { return 3 * n * (n + 1) / 2 + 5 * n; }"


def _answer(n: int) -> str:
    return str(3 * n * (n + 1) // 2 + 5 * n)


ROW = {
    "language": "c",
    "reference": SLOW,
    "harness": HARNESS,
    "compile_flags": ["-O0"],
    "tests": [{"stdin": "1\n2\n10\n", "expected_stdout": f"{_answer(1)}\n{_answer(2)}\n{_answer(10)}\n"}],
    "hidden_tests": [{"stdin": "0\n7\n12345\n", "expected_stdout": f"{_answer(0)}\n{_answer(7)}\n{_answer(12345)}\n"}],
    "bench_stdin": "200000\n",
}


@pytest.fixture(scope="module")
def backend():
    from sandbox.process import ProcessBackend

    b = ProcessBackend(slots=2)
    yield b
    b.close()


def _rewards(completions: list[str], row: dict = ROW, backend_name: str = "process") -> list:
    cols = {k: [v] * len(completions) for k, v in row.items()}
    return speedup_reward([""] * len(completions), completions, backend=backend_name, **cols)


def test_speedup_to_reward_is_bounded_log_speedup():
    assert speedup_to_reward(1.0) == pytest.approx(0.2)
    assert speedup_to_reward(10.0) == pytest.approx(0.2 + 0.8 * 0.5)  # ln 10 / ln 100 = 0.5
    assert speedup_to_reward(1e6) == 1.0
    assert speedup_to_reward(1e-6) == 0.0


def test_runner_statuses(backend):
    ok = run_job(Job(Language.C, '#include <stdio.h>\nint main(){int a,b;scanf("%d %d",&a,&b);printf("%d\\n",a+b);}',
                     tests=(TestCase("2 3", "5"), TestCase("10 -4\n", "6\n"))), backend)
    assert ok.status is Status.OK and ok.tests_passed == 2 and ok.backend == "process", ok
    bad = run_job(Job(Language.C, "int main( {"), backend)
    assert bad.status is Status.COMPILE_ERROR and "error" in bad.stderr_tail
    wrong = run_job(Job(Language.PYTHON, "print(int(input()) * 2)", tests=(TestCase("3", "6"), TestCase("4", "9"))),
                    backend)
    assert wrong.status is Status.WRONG_ANSWER and wrong.tests_passed == 1 and "test 2 of 2" in wrong.detail
    cpp = run_job(Job(Language.CPP, "#include <iostream>\nint main(){long x; std::cin>>x; std::cout<<x*x<<'\\n';}",
                      tests=(TestCase("12", "144"),)), backend)
    assert cpp.status is Status.OK, cpp
    crash = run_job(Job(Language.PYTHON, "raise SystemExit(4)", tests=(TestCase("", ""),)), backend)
    assert crash.status is Status.RUNTIME_ERROR and "exit code 4" in crash.detail


def test_instruction_counts_are_deterministic_and_cpu_time_reports_spread(backend):
    job = Job(Language.C, SLOW, harness=HARNESS, sentinel="end-x", compile_flags=("-O0",),
              tests=(TestCase("3", _answer(3)),), bench_stdin="100000")
    a, b = run_job(job, backend), run_job(job, backend)
    assert a.status is Status.OK and a.measurement.method is Method.INSTRUCTIONS
    assert a.measurement.value == b.measurement.value > 100000
    timed = run_job(Job(**{**job.__dict__, "method": Method.CPU_TIME, "repeats": 3}), backend)
    assert timed.measurement.method is Method.CPU_TIME and timed.measurement.runs == 3
    assert timed.measurement.unit == "s" and timed.measurement.spread >= 0


def test_reference_copy_scores_exactly_the_correct_bonus_and_fast_code_more(backend):
    ref, fast, wrong = _rewards([SLOW, FAST, FAST.replace("5 * n", "4 * n")])
    assert ref == pytest.approx(0.2, abs=1e-12)  # same program, same method and input: speed-up exactly 1
    assert 0.2 < fast <= 1.0
    assert wrong == 0.0
    (j,) = judge([FAST], [ROW])
    assert j.speedup > 10 and j.result.measurement.method is Method.INSTRUCTIONS


def test_hard_coded_visible_answers_fail_hidden_tests(backend):
    cheat = ("long f(long n) { if (n == 1) return 8; if (n == 2) return 19; if (n == 10) return 215; return 0; }")
    assert [_answer(1), _answer(2), _answer(10)] == ["8", "19", "215"]
    (j,) = judge([cheat], [ROW])
    assert j.result.status is Status.WRONG_ANSWER and "hidden" in j.result.detail
    assert _rewards([cheat]) == [0.0]


def test_reading_or_writing_outside_the_work_dir_earns_nothing(backend, tmp_path):
    # The right coefficient (5) sits in a host file: a program that can read it is correct.
    hint = tmp_path / "hint.txt"
    hint.write_text("5\n")
    os.chmod(tmp_path, 0o777)
    reader = ('#include <stdio.h>\n'
              'long f(long n) { long c = 4; FILE *fp = fopen("%s", "r");'
              ' if (fp) { if (fscanf(fp, "%%ld", &c) != 1) c = 4; fclose(fp); }'
              ' return 3 * n * (n + 1) / 2 + c * n; }' % hint)
    planted = tmp_path / "planted.txt"
    writer = ('#include <stdio.h>\nlong f(long n) { FILE *fp = fopen("%s", "w");'
              ' if (!fp) return 0; fputs("x", fp); fclose(fp); return 3 * n * (n + 1) / 2 + 5 * n; }' % planted)
    assert _rewards([reader, writer]) == [0.0, 0.0]
    assert not planted.exists()
    # The same programs outside any sandbox do get paid: the sandbox is what stops them.
    unsafe = _rewards([reader, writer], backend_name="unsafe_local")
    assert unsafe[0] > 0 and unsafe[1] > 0 and planted.exists()


def test_spawning_a_process_or_exiting_early_earns_nothing(backend):
    forker = ("#include <unistd.h>\nlong f(long n) { if (fork() < 0) return -1; return 3 * n * (n + 1) / 2 + 5 * n; }")
    shell = ('#include <stdlib.h>\nlong f(long n) { system("true"); return 3 * n * (n + 1) / 2 + 5 * n; }')
    early = ('#include <stdio.h>\n#include <stdlib.h>\n'
             'long f(long n) { printf("%ld\\n", 3 * n * (n + 1) / 2 + 5 * n); exit(0); }')
    judged = judge([forker, shell, early], [ROW] * 3)
    assert [j.result.status for j in judged] == [Status.RUNTIME_ERROR] * 3, [j.result.detail for j in judged]
    assert "harness" in judged[2].result.detail
    assert _rewards([forker, shell, early]) == [0.0, 0.0, 0.0]


def test_sandbox_failures_are_errors_per_sample_not_zeros(backend):
    broken = {**ROW, "reference": "long f(long n) { return 0; }"}  # a task bug: the reference fails
    scorer = RewardScorer([RewardFunctionSpec("reward.code_speedup:speedup_reward", kwargs={"backend": "process"})])
    samples = [Sample(prompt_text="", completion_text=FAST, prompt_ids=[1], completion_ids=[2], logprobs=[0.0],
                      finish_reason="stop", group_id=i, sample_index=0, policy_version=0, metadata=row)
               for i, row in enumerate([ROW, broken])]
    good, bad = scorer.score(samples)
    assert good.error is None and good.reward > 0.2
    assert bad.reward is None and "reference solution did not pass" in bad.error


def test_a_planted_valgrindrc_does_not_change_the_measurement(backend):
    # A test run writes .valgrindrc into the work dir, asking callgrind not to count anything.
    planter = ('#include <stdio.h>\nlong f(long n) { FILE *fp = fopen(".valgrindrc", "w");'
               ' if (fp) { fputs("--collect-atstart=no\\n--instr-atstart=no\\n", fp); fclose(fp); }'
               ' return 3 * n * (n + 1) / 2 + 5 * n; }')
    honest, planted = judge([FAST, planter], [ROW, ROW])
    assert planted.result.status is Status.OK
    assert planted.speedup <= honest.speedup  # it also did the file write: never cheaper than honest
