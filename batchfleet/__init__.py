"""batchfleet: put a model behind a queue.

Producers write requests to Redis streams (one per model and priority lane); a fleet
of Celery workers reads them in micro-batches, runs the model, and writes results.
"""

__version__ = "0.1.0"
