"""Text generation: the pieces of the ``text-generation`` runner (sampling, incremental
detokenization, the continuous-batching engine it drives)."""
