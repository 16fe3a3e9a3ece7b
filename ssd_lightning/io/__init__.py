"""Files: weight/checkpoint reading and writing, atomic writes, run loggers."""
