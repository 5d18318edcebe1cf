"""Deployment tooling: the Grafana dashboard generator and the Kubernetes manifest helpers.

Not part of the installed package: these run from a checkout (`python -m deploy.dashboard`)
and in the tests; the image never needs them.
"""
