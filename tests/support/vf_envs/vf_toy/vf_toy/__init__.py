"""A small verifiers environment for the tests: say a word back (verifiers' task-centric contract, v0.4)."""

import verifiers.v1 as vf


class EchoData(vf.TaskData):
    answer: str


class EchoConfig(vf.TasksetConfig):
    words: tuple[str, ...] = ("ok", "yes", "no", "hi")
    repeat: int = 2


class EchoTask(vf.Task[EchoData]):
    @vf.reward(weight=1.0)
    async def said_it(self, trace) -> float:
        text = trace.last_message.content if trace.messages else ""
        return 1.0 if isinstance(text, str) and self.data.answer in text.lower() else 0.0

    @vf.metric
    async def chars(self, trace) -> float:
        text = trace.last_message.content if trace.messages else ""
        return float(len(text)) if isinstance(text, str) else 0.0


class EchoTaskset(vf.Taskset[EchoTask, EchoConfig]):
    def load(self):
        for _ in range(self.config.repeat):
            for word in self.config.words:
                yield EchoTask(EchoData(prompt=f"Say {word}.", answer=word), self.config.task)


__all__ = ["EchoConfig", "EchoTask", "EchoTaskset"]
