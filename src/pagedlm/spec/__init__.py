"""Speculative decoding's draft side: proposers behind one interface (proposer.py), n-gram prompt lookup
(ngram.py), suffix drafts (suffix.py), OpenAI's Predicted Outputs (prediction.py), a draft model (draft_model.py)
and each sequence's adaptive draft length (state.py). The engine verifies the drafts (engine/spec_decode.py): this
package knows token ids, not requests; only the draft model keeps a KV cache, its own, through a block manager and a
forward function the engine gives it."""
