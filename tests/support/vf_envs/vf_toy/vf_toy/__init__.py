"""A small verifiers environment for the tests: say a word back (verifiers' task-centric contract, v0.4)."""

import verifiers.v1 as vf


class EchoData(vf.TaskData):
    answer: str
    fail: bool = False


class EchoConfig(vf.TasksetConfig):
    words: tuple[str, ...] = ("ok", "yes", "no", "hi")
    repeat: int = 2
    fail_on: str = ""  # this word's episodes break in scoring (an environment that fails)


class EchoTask(vf.Task[EchoData]):
    @vf.reward(weight=1.0)
    async def said_it(self, trace) -> float:
        if self.data.fail:
            raise RuntimeError("this task's scorer broke")
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
                data = EchoData(prompt=f"Say {word}.", answer=word, fail=word == self.config.fail_on)
                yield EchoTask(data, self.config.task)


__all__ = ["EchoConfig", "EchoTask", "EchoTaskset"]
