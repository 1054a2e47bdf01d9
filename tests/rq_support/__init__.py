"""Support code for the RQ suites: job functions that worker subprocesses import by name."""
