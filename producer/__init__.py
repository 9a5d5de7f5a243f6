"""Submit inference requests and get their results: ``Producer`` and ``AsyncProducer``."""

from ..schemas.errors import (
    JobFailed,
    NotStreamed,
    ProducerClosed,
    RequestRejected,
    ResultTimeout,
    StreamRestarted,
)
from ..schemas.messages import ChatMessage, Delta, Generation, Result
from .aio import AsyncJob, AsyncProducer
from .client import Job, Producer
from .tokens import Restarted

__all__ = [
    "AsyncJob",
    "AsyncProducer",
    "ChatMessage",
    "Delta",
    "Generation",
    "Job",
    "JobFailed",
    "NotStreamed",
    "Producer",
    "ProducerClosed",
    "RequestRejected",
    "Restarted",
    "Result",
    "ResultTimeout",
    "StreamRestarted",
]
