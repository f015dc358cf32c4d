"""The OpenAI-compatible server (api.py), its command line (cli.py) and metrics."""

DEFAULT_MAX_PROMPTS_PER_REQUEST = 256  # prompts x n (or beam_width) of one request
