"""`python -m ingest.torch.autoload` prints the PYTHONPATH entries for torchrun auto-tracing:
this directory (its sitecustomize.py) and the directory that holds the `ingest` package."""
