"""Markdown tables for the benchmark tools (no flags here, so every tool can import it)."""


def fmt(v) -> str:
    if isinstance(v, float):
        return "nan" if v != v else (f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}")
    return "" if v is None else str(v)


def markdown(rows, cols) -> str:
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(fmt(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(out)
