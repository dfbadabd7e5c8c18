"""Worker runtime: training loop, process-group (re)formation, heartbeats, state serving."""
