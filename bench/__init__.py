"""Benchmarks: batchfleet side by side with Celery and celery-batches (``python -m bench``)."""
