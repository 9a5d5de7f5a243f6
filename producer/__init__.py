"""Submit inference requests and get their results: ``Producer`` and ``AsyncProducer``."""

from ..schemas.errors import JobFailed, RequestRejected, ResultTimeout
from ..schemas.messages import Result
from .aio import AsyncJob, AsyncProducer
from .client import Job, Producer

__all__ = [
    "AsyncJob",
    "AsyncProducer",
    "Job",
    "JobFailed",
    "Producer",
    "RequestRejected",
    "Result",
    "ResultTimeout",
]
