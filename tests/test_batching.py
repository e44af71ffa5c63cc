import torch

from domino.batching import InterleavedEngine
from domino.decoding import GenerationConfig, SpeculativeDecoder
from helpers import tiny_drafter, tiny_target


def test_interleaved_requests_each_get_their_own_greedy_output():
    target = tiny_target(init_std=0.1)
    target.model.double()
    decoder = SpeculativeDecoder(target, tiny_drafter(target, head="domino").double())
    generator = torch.Generator().manual_seed(0)
    prompts = {f"r{i}": torch.randint(0, 96, (3 + 5 * i,), generator=generator).tolist() for i in range(4)}
    budgets = {f"r{i}": 6 + 9 * i for i in range(4)}
    expected = {rid: decoder.generate(p, GenerationConfig(max_new_tokens=budgets[rid], stop_token_ids=[])).tokens
                for rid, p in prompts.items()}
    engine = InterleavedEngine(decoder)
    got = {rid: [] for rid in prompts}
    finished = {}
    steps = 0
    for rid in ["r0", "r1"]:
        engine.add(rid, prompts[rid], GenerationConfig(max_new_tokens=budgets[rid], stop_token_ids=[]))
    engine.add("gone", prompts["r3"], GenerationConfig(max_new_tokens=50, stop_token_ids=[]))
    while engine.has_work:
        if steps == 2:  # requests join mid-flight, one leaves
            for rid in ["r2", "r3"]:
                engine.add(rid, prompts[rid], GenerationConfig(max_new_tokens=budgets[rid], stop_token_ids=[]))
            engine.cancel("gone")
        for event in engine.step():
            assert event.request_id != "gone" or steps < 2
            if event.request_id in got:
                got[event.request_id] += event.tokens
                if event.finished:
                    finished[event.request_id] = event.result
        steps += 1
    assert got == expected
    assert all(finished[rid].tokens == expected[rid] for rid in prompts)
