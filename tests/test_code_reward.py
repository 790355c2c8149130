"""The sandbox runner and the code speed-up reward, end to end through the real process sandbox:
statuses, the exit-early guard, deterministic measurement, and the reward-hacking guards."""

from __future__ import annotations

import os

import pytest

from reward.code_speedup import SandboxFailure, judge, make_job, speedup_reward, speedup_to_reward
from reward.scorer import RewardFunctionSpec, RewardScorer
from rl.data.types import Sample
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


# -- a program that behaves differently when measured earns nothing --------------------------

def _measured_wrong(detect: str) -> str:
    """A correct, fast `f` that returns a wrong value when `detect` (C, a condition) holds."""
    return ('#include <stdio.h>\n#include <string.h>\n'
            'static int under_valgrind(void) { FILE *m = fopen("/proc/self/maps", "r"); char line[512]; int hit = 0;'
            ' while (m && fgets(line, sizeof line, m)) if (strstr(line, "valgrind")) hit = 1;'
            ' if (m) fclose(m); return hit; }\n'
            'long f(long n) { if (%s) return 0; return 3 * n * (n + 1) / 2 + 5 * n; }' % detect)


@pytest.mark.slow  # over a second: real processes or a whole command line (not the fast lane)
@pytest.mark.parametrize("detect", ["under_valgrind()", "n > 150000"], ids=["valgrind_in_maps", "bench_sized_input"])
def test_a_harness_candidate_that_skips_the_work_when_measured_earns_nothing(backend, detect):
    cheat = _measured_wrong(detect)
    # It does tell the measured run apart: unchecked, its benchmark run prints 0, fast.
    unchecked = run_job(make_job(cheat, ROW), backend)
    assert unchecked.status is Status.OK and unchecked.bench_stdout == "0", unchecked
    judged, honest = judge([cheat, FAST], [ROW, ROW])
    assert judged.result.status is Status.WRONG_ANSWER and judged.error is None
    assert judged.result.detail == f"benchmark run: expected {_answer(200000)!r}, got '0'", judged.result.detail
    assert judged.result.tests_passed == judged.result.tests_total == 2   # every test passed
    assert honest.result.status is Status.OK and honest.speedup > 10
    cheat_reward, honest_reward = _rewards([cheat, FAST])
    assert cheat_reward == 0.0 and honest_reward > 0.2


def _whole(body: str) -> str:
    """A whole program (no harness): reads n, prints one number (`body` computes s from n)."""
    return ('#include <stdio.h>\n#include <stdlib.h>\nint main(void) { long n, s = 0;'
            ' if (scanf("%%ld", &n) != 1) return 1; %s printf("%%ld\\n", s); return 0; }' % body)


WHOLE_SLOW = _whole("for (long i = 1; i <= n; i++) s += 3 * i + 5;")
WHOLE_FAST = _whole("s = 3 * n * (n + 1) / 2 + 5 * n;")
WHOLE_ROW = {
    "language": "c",
    "reference": WHOLE_SLOW,
    "harness": None,
    "compile_flags": ["-O0"],
    "tests": [{"stdin": "10\n", "expected_stdout": _answer(10) + "\n"}],
    "hidden_tests": [{"stdin": "12345\n", "expected_stdout": _answer(12345) + "\n"}],
    "bench_stdin": "200000\n",
}


def test_a_whole_program_that_skips_the_work_when_measured_earns_nothing(backend):
    # valgrind puts its preload library into the environment; this program then prints 0 at once
    cheat = _whole('if (getenv("LD_PRELOAD")) { puts("0"); return 0; } s = 3 * n * (n + 1) / 2 + 5 * n;')
    unchecked = run_job(make_job(cheat, WHOLE_ROW), backend)
    assert unchecked.status is Status.OK and unchecked.bench_stdout == "0", unchecked
    judged, honest = judge([cheat, WHOLE_FAST], [WHOLE_ROW, WHOLE_ROW])
    assert judged.result.status is Status.WRONG_ANSWER and judged.error is None
    assert judged.result.detail.startswith("benchmark run: expected"), judged.result.detail
    assert honest.result.status is Status.OK and honest.speedup > 10
    cheat_reward, honest_reward, copy_reward = _rewards([cheat, WHOLE_FAST, WHOLE_SLOW], WHOLE_ROW)
    assert cheat_reward == 0.0 and honest_reward > 0.2
    assert copy_reward == pytest.approx(0.2, abs=1e-12)


def test_a_reference_with_no_benchmark_output_is_an_error_not_a_zero(backend):
    # the reference exits without a word on the (large) benchmark input
    quiet = _whole("if (n > 150000) return 0; for (long i = 1; i <= n; i++) s += 3 * i + 5;")
    silent = {**WHOLE_ROW, "reference": quiet}
    (j,) = judge([WHOLE_FAST], [silent])
    assert isinstance(j.error, SandboxFailure) and "printed nothing on the benchmark input" in str(j.error)
    (reward,) = _rewards([WHOLE_FAST], silent)
    assert isinstance(reward, SandboxFailure)


def test_measured_runs_start_from_the_work_dir_as_built(backend):
    # A test run leaves a locked-up dir tree; the measured run would answer wrongly if it saw it.
    leaver = ('#include <sys/stat.h>\n#include <stdio.h>\n'
              'long f(long n) { struct stat st;'
              ' if (n == 1) { mkdir("state", 0700); mkdir("state/x", 0700);'
              ' FILE *fp = fopen("state/x/leftover", "w"); if (fp) fclose(fp);'
              ' chmod("state/x", 0); chmod("state", 0500); chmod(".", 0500); }'
              ' if (n > 150000 && stat("state", &st) == 0) return -1;'
              ' return 3 * n * (n + 1) / 2 + 5 * n; }')
    # A test run replaces the program that is measured afterwards (here: by itself plus a byte).
    patcher = ('#include <stdio.h>\n#include <sys/stat.h>\n'
               'long f(long n) { if (n == 1) { FILE *in = fopen("prog", "rb"), *out = fopen("p2", "wb"); int c;'
               ' if (in && out) { while ((c = fgetc(in)) != EOF) fputc(c, out); fputc(0, out); }'
               ' if (in) fclose(in); if (out) fclose(out); chmod("p2", 0755); rename("p2", "prog"); }'
               ' return 3 * n * (n + 1) / 2 + 5 * n; }')
    left, patched = judge([leaver, patcher], [ROW, ROW])
    assert left.result.status is Status.OK and left.speedup > 10, left.result
    assert patched.result.status is Status.RUNTIME_ERROR and patched.result.tests_passed == 2, patched.result
    assert patched.result.detail == ("benchmark run: the work dir could not be reset to what was built "
                                     "(prog was changed after it was built)"), patched.result.detail


PY_ROW = {
    "language": "python",
    "reference": "n = int(input())\nprint(sum(3 * i + 5 for i in range(1, n + 1)))\n",
    "harness": None,
    "tests": [{"stdin": "10\n", "expected_stdout": _answer(10) + "\n"}],
    "hidden_tests": [{"stdin": "12345\n", "expected_stdout": _answer(12345) + "\n"}],
    "bench_stdin": "3000000\n",
}


@pytest.mark.slow  # over a second: real processes or a whole command line (not the fast lane)
def test_cpu_time_repeats_cannot_reuse_what_an_earlier_repeat_left(backend):
    # Correct every time, but caches its answer in the work dir: with the min over repeats, a
    # cached repeat would pass for a ~10x speed-up (measured without the reset).
    cacher = ("import os\nn = int(input())\nkey = f'cache-{n}'\n"
              "if os.path.exists(key):\n    print(open(key).read())\n"
              "else:\n    s = sum(3 * i + 5 for i in range(1, n + 1))\n"
              "    open(key, 'w').write(str(s))\n    print(s)\n")
    # Rewrites its own source into a closed form after a run (the next run would be fast).
    closed_form = "n = int(input())\\nprint(3 * n * (n + 1) // 2 + 5 * n)\\n"
    rewriter = PY_ROW["reference"] + f"open(__file__, 'w').write('{closed_form}')\n"
    cached, rewritten = judge([cacher, rewriter], [PY_ROW, PY_ROW], method="cpu_time")
    assert cached.result.status is Status.OK and cached.result.measurement.runs == 5
    assert cached.speedup < 3, cached.speedup
    assert rewritten.result.status is Status.RUNTIME_ERROR
    assert "solution.py was changed after it was built" in rewritten.result.detail, rewritten.result.detail
