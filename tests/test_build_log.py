"""Reading a failed build's log (no engine): the step and the reason a user sees, whatever order BuildKit printed
the step's stdout and stderr in."""
import itertools

import pytest

from builder.engine import failed_step, failure_fix

PIP = "python3 -m venv /opt/venv && /opt/venv/bin/pip install --index-url https://10.0.0.1/simple/ probe==0.1"
FETCH = ("#5 2.32 Could not fetch URL https://10.0.0.1/simple/probe/: There was a problem confirming the ssl "
         "certificate: HTTPSConnectionPool(...) (Caused by SSLError(SSLCertVerificationError(1, '[SSL: "
         "CERTIFICATE_VERIFY_FAILED] certificate verify failed: self-signed certificate'))) - skipping")
FIND = "#5 2.33 ERROR: Could not find a version that satisfies the requirement probe==0.1 (from versions: none)"
NOMATCH = "#5 2.33 ERROR: No matching distribution found for probe==0.1"


@pytest.mark.parametrize("body", [list(p) for p in itertools.permutations([FETCH, FIND, NOMATCH])
                                  if p.index(FIND) < p.index(NOMATCH)])   # stderr keeps its own order
def test_pip_error_line_is_the_reason_however_stdout_and_stderr_interleave(body):
    """CI once printed pip's stdout line ("Could not fetch URL", which names SSLError) after its stderr ERROR
    lines; the reason must still be pip's last ERROR line, with the TLS cause and fix in front."""
    lines = ["#4 [1/2] FROM docker.io/library/debian:bookworm", f"#5 [2/2] RUN {PIP}", *body,
             f"#5 ERROR: process \"/bin/sh -c {PIP}\" did not complete successfully: exit code: 1"]
    step, reason = failed_step(lines)
    assert step == f"RUN {PIP} (2/2)"
    assert reason.startswith("TLS certificate verification failed (CERTIFICATE_VERIFY_FAILED) inside the build: "
                             "ERROR: No matching distribution found for probe==0.1 (process "), reason
    assert "images/certs/NAME.crt" in failure_fix(step, reason)


def test_apt_error_line_wins_over_a_line_that_only_mentions_an_error():
    lines = ["#6 [3/3] RUN apt-get install -y nosuchpkg", "#6 1.0 E: Unable to locate package nosuchpkg",
             "#6 1.1 debconf: delaying package configuration, since apt-utils is not installed (no error)",
             "#6 ERROR: process \"/bin/sh -c apt-get install -y nosuchpkg\" did not complete successfully: exit code: 100"]
    step, reason = failed_step(lines)
    assert step == "RUN apt-get install -y nosuchpkg (3/3)"
    assert reason.startswith("E: Unable to locate package nosuchpkg (process "), reason
    assert failure_fix(step, reason) is None


def test_a_step_without_error_lines_keeps_buildkits_reason():
    lines = ["#7 [2/2] RUN exit 3", "#7 ERROR: process \"/bin/sh -c exit 3\" did not complete successfully: exit code: 3"]
    assert failed_step(lines) == ("RUN exit 3 (2/2)",
                                  "process \"/bin/sh -c exit 3\" did not complete successfully: exit code: 3")
