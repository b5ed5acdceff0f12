"""Development tools: the benchmark (`make bench`), the soak (`make soak`) and the
server launcher they share with the tests. Not part of the shipped package."""
