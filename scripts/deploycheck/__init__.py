"""Offline validation of shelfsync's deployment files (compose/, k8s/, the Dockerfile, the
monitoring rules) and a live run of the binaries with the compose NATS permissions.

Run by scripts/validate-deploy.sh, which finds or installs the tools (in a virtualenv) and passes
their paths in the environment: `python -m deploycheck [--no-live]`. Its own tests:
`python -m unittest discover -s scripts/deploycheck/tests -t scripts`."""
