"""`make bench`: side-by-side figures for tierckpt against plain boto3.

The machine the benchmark runs on is assumed to be small and shared, so no
absolute time is meaningful on its own: every figure is a ratio of two
variants measured in the same run, against the same SeaweedFS server and the
same files, repeated and reported with its spread. See benchmarks/run.py.
"""
