from svc_pair import engines  # noqa: F401 (the fixture, for test_sender.py)
