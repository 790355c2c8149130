"""Hostile C and Python programs through `run_job` on the process backend: each must be judged
with the right status, promptly, and leave no process of the slot uids behind."""

from __future__ import annotations

import socket
import time

import pytest

from sandbox.detect import missing, probe_host
from sandbox.job import Job, Language, Limits, Status, TestCase
from sandbox.runner import run_job

pytestmark = pytest.mark.skipif(bool(missing(probe_host())), reason="host cannot isolate")

LIMITS = Limits(wall_s=2.0, cpu_s=1.0, memory_mb=64, output_bytes=64 << 10, file_bytes=1 << 20)
ONE_TEST = (TestCase(stdin="", expected_stdout="ok"),)

C = {
    "fork_bomb": "#include <unistd.h>\nint main(void){for(;;) fork();}\n",
    "infinite_loop": "int main(void){volatile unsigned long i=0; for(;;) i++;}\n",
    "sleep": "#include <unistd.h>\nint main(void){sleep(100); return 0;}\n",
    "memory_bomb": "#include <stdlib.h>\n#include <string.h>\nint main(void){for(;;){"
                   "char *p=malloc(1<<20); if(!p) return 2; memset(p,1,1<<20);}}\n",
    "stdout_10gb": "#include <unistd.h>\nstatic char b[1<<16];\nint main(void){"
                   "for(long i=0;i<163840;i++) if(write(1,b,sizeof b)<0) return 1; return 0;}\n",
    "file_10gb": '#include <stdio.h>\nstatic char b[1<<16];\nint main(void){FILE *f=fopen("big","w");'
                 " for(long i=0;i<163840;i++) if(fwrite(b,1,sizeof b,f)!=sizeof b) return 1;"
                 " return 0;}\n",
}
PY = {
    "fork_bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
    "infinite_loop": "while True:\n    pass\n",
    "sleep": "import time\ntime.sleep(100)\n",
    "memory_bomb": "a = []\nwhile True:\n    a.append(bytearray(1 << 20))\n",
    "stdout_10gb": "import sys\nb = b'x' * 65536\nfor _ in range(163840):\n    sys.stdout.buffer.write(b)\n",
    "file_10gb": "b = b'x' * 65536\nwith open('big', 'wb') as f:\n    for _ in range(163840):\n"
                 "        f.write(b)\n",
}
EXPECTED = {
    "fork_bomb": Status.RUNTIME_ERROR,
    "infinite_loop": Status.TIMEOUT,
    "sleep": Status.TIMEOUT,
    "memory_bomb": Status.MEMORY_LIMIT,
    "stdout_10gb": Status.OUTPUT_LIMIT,
    "file_10gb": Status.OUTPUT_LIMIT,
}


@pytest.fixture(scope="module")
def backend():
    from sandbox.process import ProcessBackend

    be = ProcessBackend(slots=2)
    yield be
    be.close()


def _leftovers(uids: list[int]) -> list[str]:
    import os

    out = []
    for entry in os.scandir("/proc"):
        try:
            if entry.name.isdigit() and os.stat(entry.path).st_uid in uids:
                out.append(entry.name)
        except FileNotFoundError:
            continue
    return out


@pytest.mark.slow  # over a second: real processes or a whole command line (not the fast lane)
@pytest.mark.parametrize("lang", [Language.C, Language.PYTHON])
@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_hostile_program_status(backend, lang, case):
    source = (C if lang is Language.C else PY)[case]
    t = time.monotonic()
    result = run_job(Job(language=lang, source=source, tests=ONE_TEST, limits=LIMITS), backend)
    took = time.monotonic() - t
    assert result.status is EXPECTED[case], result
    assert result.backend == "process"
    assert took < 5, took            # compile + a run of at most wall_s=2 + cleanup
    assert not _leftovers(backend.uids)


@pytest.mark.parametrize("lang", [Language.C, Language.PYTHON])
def test_socket_gets_no_connection(backend, lang):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    srv.setblocking(False)
    port = srv.getsockname()[1]
    try:
        if lang is Language.C:
            source = ("#include <stdio.h>\n#include <sys/socket.h>\n#include <netinet/in.h>\n"
                      "#include <arpa/inet.h>\nint main(void){int s=socket(AF_INET,SOCK_STREAM,0);"
                      " struct sockaddr_in a={0}; a.sin_family=AF_INET;"
                      f" a.sin_port=htons({port}); a.sin_addr.s_addr=inet_addr(\"127.0.0.1\");"
                      ' if(s<0||connect(s,(void*)&a,sizeof a)<0) return 1; puts("ok"); return 0;}\n')
        else:
            source = (f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
                      "print('ok')\n")
        result = run_job(Job(language=lang, source=source, tests=ONE_TEST, limits=LIMITS), backend)
        assert result.status in (Status.RUNTIME_ERROR, Status.WRONG_ANSWER), result
        time.sleep(0.1)
        with pytest.raises(BlockingIOError):
            srv.accept()
    finally:
        srv.close()
