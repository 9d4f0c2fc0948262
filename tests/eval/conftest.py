"""A fixture for the row tests: configurations measured once each, on first use, against one
prepared reference (tests/eval is not a package: a helper module could not be imported)."""
from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from moebus.eval.run import Result, Settings, prepare, run_configs


class Rows:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.reference, self.hf_path = prepare(settings)
        self.done: dict[str, Result] = {}

    def __call__(self, name: str) -> Result:
        if name not in self.done:
            r = self.done[name] = next(run_configs(self.settings, self.reference, self.hf_path, [name]))
            g = r.greedy
            print(f"\n{name} ({r.seconds:.1f} s): KL {r.ppl.kl:.2e}, same top {r.ppl.same_top_pct:.1f}%; greedy "
                  f"matched {g.matched}/{g.prompts}, ties {len(g.ties)}, diverged "
                  f"{[(d.prompt, d.position, round(d.margin, 4)) for d in g.real]}; {r.counters}")
        return self.done[name]


@pytest.fixture(scope="session")
def eval_rows() -> type[Rows]:
    return Rows


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    # Two intra-op threads on two shared cores run the small models several times slower than one.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
