"""`psctl deploy`: systemd units and per-host files from one cluster file, and a check that
every host answers. No TensorFlow here.

`plan.py` groups the cluster's tasks by host with their ports; `units.py` fills the unit and
env file templates (``templates/``); `readme.py` writes the per-host READMEs; `render.py` is
`psctl deploy render` (``python -m psctl.coordinator.deploy.render`` rewrites deploy/systemd/,
the units rendered for /opt/psctl/venv; a test fails when it is stale); `check.py` is
`psctl deploy check`. Their flags: coordinator/cli/deploy.py.
"""
