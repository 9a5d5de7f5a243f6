"""Webhook delivery: results POSTed to the URL a request carries, signed per Standard Webhooks,
retried by Celery tasks on the ``webhooks`` queue, and guarded against SSRF."""
