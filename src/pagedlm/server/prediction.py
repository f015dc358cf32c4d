"""OpenAI's Predicted Outputs on the wire: the request's `prediction` (the text the answer is expected to repeat,
e.g. the file being edited) and what usage reports of it. The engine drafts from the prediction's tokens
(pagedlm/spec/prediction.py) and counts the draft tokens it accepted; `rejected_prediction_tokens` is, as OpenAI
defines it, the prediction's tokens that did not appear in the completion: its length (once per sample) less the
accepted tokens."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from pagedlm.outputs import RequestMetrics

_REQUEST = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)  # as protocol.Request


class PredictionText(BaseModel):
    model_config = _REQUEST
    type: Literal["text"]
    text: str


class Prediction(BaseModel):
    model_config = _REQUEST
    type: Literal["content"]
    content: str | list[PredictionText]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class CompletionTokensDetails(BaseModel):
    model_config = ConfigDict(extra="forbid")
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0
    reasoning_tokens: int = 0


def prediction_details(prediction_tokens: int, samples: int, metrics: list[RequestMetrics | None]
                       ) -> CompletionTokensDetails:
    """Usage details of prompts whose requests (their latest `metrics`, one per prompt) each ran `samples`
    samples with a prediction of `prediction_tokens` tokens."""
    accepted = [m.spec_accepted_tokens if m is not None else 0 for m in metrics]
    return CompletionTokensDetails(accepted_prediction_tokens=sum(accepted), rejected_prediction_tokens=sum(
        max(0, prediction_tokens * samples - a) for a in accepted))
