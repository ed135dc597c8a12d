"""``lmscale serve``: the model and a function index behind an HTTP API (FastAPI + uvicorn) and
one web page (``static/index.html``); the contract is docs/using-the-model.md's "Serve"."""
