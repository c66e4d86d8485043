"""A str that counts the characters its find() looks at: how the servers'
tests (test_verifiers.py here, ../env-server/test_envs.py) show that a
scan is linear without timing it. Nothing here is used by the servers."""


class CountingStr(str):
    """A str whose find() counts the characters it looks at."""

    looked = 0

    def find(self, sub, start=0, end=None):
        end = len(self) if end is None else end
        at = str.find(self, sub, start, end)
        CountingStr.looked += (at + len(sub) if at >= 0 else end) - start
        return at
