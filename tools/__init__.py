"""Operator tools that nothing else imports: the ``sdforge`` CLI, the local stack, the demo report, the kill harness."""

import sdforge  # noqa: F401  (first: silences known library messages before any import logs them)
