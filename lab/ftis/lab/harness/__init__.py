"""In-process test harnesses: a coordinator on a fake clock and the fuzzers built on it."""
