"""``python -m bench``: placeholder until the benchmark lands (issue: bench/)."""

STAGES = ("routing", "prepare", "quantize", "permute", "dispatch", "combine", "layer")


def main() -> None:
    print("bench: not written yet. Planned stages: " + ", ".join(STAGES))


if __name__ == "__main__":
    main()
