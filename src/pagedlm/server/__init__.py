"""The OpenAI-compatible server (api.py builds the app; see its docstring), its command line (cli.py) and metrics."""

DEFAULT_MAX_PROMPTS_PER_REQUEST = 256  # prompts x n (or beam_width) of one request
