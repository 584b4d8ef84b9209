"""One call's life in the router: validation, the completion's text (stop strings, reasoning, tool calls),
limits, accounting, spans and metrics, and the call that relays a worker's updates. Imports the fleet only."""
