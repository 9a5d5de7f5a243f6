"""An OpenAI-compatible HTTP gateway in front of the fleet (``batchfleet gateway``)."""
