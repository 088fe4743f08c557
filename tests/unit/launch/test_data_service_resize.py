"""Which resizes a job fed by the tf.data service takes (launch/resize.py,
check_data_service_resize): --epochs none, --follow any that keeps every worker, a job
trained by --steps all; each refusal one line naming the flag."""

from __future__ import annotations

import pytest

from psctl.cluster.errors import ConfigError
from psctl.coordinator.launch.resize import check_data_service_resize

pytestmark = pytest.mark.timeout(30)

OLD = ("10.0.0.1:2222", "10.0.0.2:2222")


@pytest.mark.parametrize(
    ("flag", "new", "refused"),
    [
        ("", OLD[:1], None),  # --steps: anything
        ("--follow", (*OLD, "10.0.0.3:2222"), None),  # a worker added
        ("--follow", OLD, None),  # the ps changed, the workers kept
        ("--follow", ("10.0.0.2:2222", "10.0.0.1:2222"), None),  # reordered, none gone
        ("--follow", OLD[:1], "10.0.0.2:2222"),  # one taken out
        ("--follow", ("10.0.0.1:2222", "10.0.0.9:2222"), "10.0.0.2:2222"),  # one replaced
        ("--epochs", (*OLD, "10.0.0.3:2222"), "exactly-once"),  # --epochs: none at all
    ],
)
def test_a_resize_keeps_every_data_worker_the_job_still_needs(flag, new, refused):
    if refused is None:
        check_data_service_resize(flag, OLD, new)
        return
    with pytest.raises(ConfigError) as caught:
        check_data_service_resize(flag, OLD, new)
    line = str(caught.value)
    assert line.startswith(f"{flag}: ") and refused in line and "\n" not in line
