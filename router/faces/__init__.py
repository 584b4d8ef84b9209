"""The router's public faces: the gRPC server and its Generate and Admin services, the OpenAI-compatible HTTP
API, auth, and the group of router processes. They import the calls and the fleet below them."""
