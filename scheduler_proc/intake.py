"""Request intake: a client's AddRequest becomes a scheduled Request (validated, given an id
and, where asked, a deadline); deadlines that pass end their requests."""
from __future__ import annotations

from spmd_runtime.protocol.messages import AddRequest, ErrorReply, ModelInfo, RequestAccepted
from spmd_runtime.scheduler_proc.admission import refusal
from spmd_runtime.scheduler_proc.request import FinishReason, Request
from spmd_runtime.scheduler_proc.scheduler import Scheduler
from spmd_runtime.scheduler_proc.served_tokenizer import ServedTokenizer


class RequestIntake:
    def __init__(self, scheduler: Scheduler, tokenizer: ServedTokenizer,
                 model_info: ModelInfo) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.model_info = model_info
        self._next_request_id = 0
        self._arrivals = 0

    def add(self, client: bytes, message: AddRequest) -> RequestAccepted | ErrorReply:
        """Queue the request; the reply says its id, or why it cannot be served."""
        try:
            prompt = self.tokenizer.prompt_token_ids(message)
            error = refusal(message, prompt, self.model_info, self.scheduler)
            if error is None and message.params.stop and self.tokenizer.missing() is not None:
                error = "stop strings need the model's tokenizer, and this model has none"
            spec = message.params.structured_output
            matcher = self.scheduler.constrained.check(spec) if error is None and spec else None
        except ValueError as refused:
            error = str(refused)
        if error is not None:
            return ErrorReply(tag=message.tag, message=error, request_id=message.request_id)
        request_id = message.request_id
        if request_id is None:
            request_id = self._free_request_id()
        self._arrivals += 1
        request = Request(request_id, prompt, message.params, client, self._arrivals,
                          message.priority)
        request.stream = message.stream or bool(message.params.stop)
        self.scheduler.add(request)
        if matcher is not None:
            self.scheduler.constrained.add(request_id, matcher)
        if message.detokenize:
            self.tokenizer.start(request_id, message.params.stop)
        if message.timeout_s is not None:
            self.scheduler.finish_rules.add_deadline(request, message.timeout_s)
        tokenized = prompt if prompt is not message.prompt_token_ids else []
        return RequestAccepted(tag=message.tag, request_id=request_id, prompt_token_ids=tokenized)

    def _free_request_id(self) -> int:
        while self.scheduler.get(self._next_request_id) is not None:
            self._next_request_id += 1
        self._next_request_id += 1
        return self._next_request_id - 1

    def expire_deadlines(self) -> list[Request]:
        """End the requests past their timeout (finish_reason "timeout"); returns them."""
        expired = self.scheduler.finish_rules.past_deadline(self.scheduler.get)
        for request in expired:
            self.scheduler.abort(request.request_id, FinishReason.TIMEOUT)
        return expired
