"""Progress of long offline work: a tqdm bar on a terminal, a few plain log lines otherwise."""
from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Callable
from typing import TextIO

from spmd_runtime.protocol.sampling import SamplingParams
from spmd_runtime.runtime.async_client import AsyncClient
from spmd_runtime.runtime.client import Prompt
from spmd_runtime.runtime.outputs import RequestOutput

log = logging.getLogger("spmd.progress")


class Progress:
    """Counts finished items. On a terminal, a bar on `stream`; otherwise a log line at every
    tenth of the total, so that redirected logs stay short and readable."""

    def __init__(self, total: int, description: str, stream: TextIO | None = None) -> None:
        stream = sys.stderr if stream is None else stream
        self.total = total
        self.description = description
        self.done = 0
        self._bar = None
        self._next_log = 1
        if stream.isatty():
            from tqdm import tqdm
            self._bar = tqdm(total=total, desc=description, unit="req", file=stream,
                             dynamic_ncols=True, leave=False)

    def update(self, count: int = 1) -> None:
        self.done += count
        if self._bar is not None:
            self._bar.update(count)
            return
        if self.done * 10 >= self._next_log * self.total or self.done == self.total:
            log.info("%s: %d/%d done", self.description, self.done, self.total)
            self._next_log = self.done * 10 // max(self.total, 1) + 1

    def write(self, line: str, stream: TextIO | None = None) -> None:
        """Print a line on `stream` (stdout by default) without breaking the bar."""
        stream = sys.stdout if stream is None else stream
        if self._bar is not None:
            self._bar.write(line, file=stream)
        else:
            print(line, file=stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def generate_with_progress(address: str, prompts: list[Prompt], params: SamplingParams,
                           description: str, alive: Callable[[], bool] | None = None,
                           auth_token: str = "",
                           on_output: Callable[[int, RequestOutput], str | None] | None = None,
                           chat: bool = False) -> list[RequestOutput]:
    """Run a batch of prompts (token ids, or texts the engine tokenizes, through the chat
    template with `chat`) to completion on the engine at `address`, showing progress.
    on_output(index, output) is called as each prompt completes, in the order they complete;
    the line it returns, if any, is printed on stdout (above the bar)."""

    async def run() -> list[RequestOutput]:
        async with AsyncClient(address, alive=alive, auth_token=auth_token) as client:
            with Progress(len(prompts), description) as progress:

                async def complete(index: int, prompt: Prompt) -> RequestOutput:
                    try:
                        [output] = await client.generate([prompt], [params], chat=chat)
                    except ValueError as error:
                        message = str(error).removeprefix("prompt 0: ")
                        raise ValueError(f"prompt {index}: {message}") from None
                    progress.update()
                    line = on_output(index, output) if on_output else None
                    if line is not None:
                        progress.write(line)
                    return output

                # Every request is sent before any reply is read (each task sends first), so
                # the engine batches them as one generate call of all of them would be.
                return list(await asyncio.gather(*(complete(index, prompt) for index, prompt
                                                   in enumerate(prompts))))

    return asyncio.run(run())
