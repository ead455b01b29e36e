"""specc: a compiler-first runtime for speculative decoding of LLMs.

>>> from specc import Session, SamplingParams
>>> session = Session("examples/smollm2-ngram.yaml")
>>> out = session.generate("Summarize: ...", SamplingParams(temperature=0, max_tokens=64))
"""

from specc.outputs import RequestOutput, RequestMetrics, SpecMetrics, TokenLogprob
from specc.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["Session", "SamplingParams", "RequestOutput", "RequestMetrics", "SpecMetrics", "TokenLogprob"]


def __getattr__(name):
    # Session pulls in torch and transformers: import it on first use only
    if name == "Session":
        from specc.session import Session

        return Session
    raise AttributeError(f"module 'specc' has no attribute {name!r}")
