"""Operator tools that nothing else imports: the ``sdforge`` CLI, the local stack, the demo report, the kill harness."""
