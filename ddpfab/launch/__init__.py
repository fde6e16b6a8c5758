"""Running a plan: the run pipeline (connect, probe, plan, execute, record), streaming and teardown,
jobs by run id (ps/stop/attach/logs), run records, replay, recovery onto a spare, failure causes."""
