"""A function the sandbox benchmark calls through the fncall pool (importable by reference)."""


def add(a: int, b: int) -> int:
    return a + b
