"""The OpenAI-compatible server (api.py builds the app; see its docstring), its command line (cli.py) and metrics."""

DEFAULT_HEALTH_STEP_TIMEOUT = 120.0  # seconds one engine step may run with requests waiting before /health is 503
DEFAULT_MAX_PROMPTS_PER_REQUEST = 256  # prompts x n (or beam_width) of one request
MAX_PROMPT_LOGPROB_ENTRIES = 1 << 20  # prompt positions x (k + 1) x copies (choices) in one response
MAX_GENERATED_LOGPROB_ENTRIES = 1 << 21  # generated tokens x (k + 1) of one request (~150 bytes each kept on host)
DEFAULT_LOGPROB_BUDGET = 1 << 22  # logprob entries all admitted requests may keep on the host at once (~600 MB)
DEFAULT_MAX_CHAT_MESSAGES = 2048  # messages of one chat request (OpenAI's own bound)
DEFAULT_MAX_PROMPT_CHARS = 1 << 22  # characters of one prompt before tokenization (a rendered chat, a text prompt)
DEFAULT_MAX_REQUESTS_PER_KEY = 256  # engine requests (prompts) one API key may have waiting or running
DEFAULT_MAX_CONNECTIONS = 1000  # open HTTP connections (see server/http.py)
DEFAULT_REQUEST_READ_TIMEOUT = 30.0  # seconds for a request's line, headers and body to arrive
DEFAULT_STAGE_THREADS = 4  # worker threads of each stage off the engine (parse, chat, tokenize, grammar, render)
DEFAULT_STAGE_QUEUE = 256  # jobs of one stage that may wait for its threads; beyond: 503 server_busy
DEFAULT_RESPONSES_STORE_SIZE = 100  # Responses API: stored responses per API key (previous_response_id)
DEFAULT_RESPONSES_STORE_TTL = 3600.0  # seconds a stored response is kept
