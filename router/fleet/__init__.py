"""The fleet of workers as the router sees it: connections, the pool and its served models, routing,
discovery, the adapter registry, tokenizers. Imports nothing else of the router."""
