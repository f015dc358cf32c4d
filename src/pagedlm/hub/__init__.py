"""Finding, downloading and reading checkpoints and tokenizers: the model registry and cache (registry), GGUF and
safetensors reading (hf_config, loader), tokenizers (tokenizer). Tensors are built from them in pagedlm.model."""
