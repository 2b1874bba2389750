"""The model configurations are made from the wire contract, and the committed ones are that output."""

import dataclasses

import pytest

from personaplex_triton.core import contract
from personaplex_triton.core.paths import MODEL_REPOSITORY, ONE_STUB_REPOSITORY
from personaplex_triton.serving import model_configs


def test_committed_configs_are_the_generated_ones():
    assert model_configs.stale() == [], \
        "a model repository differs from the contract: run python -m personaplex_triton.serving.model_configs"
    assert model_configs.main(["--check"]) == 0


def test_check_finds_a_hand_edit(tmp_path):
    model_configs.write(tmp_path)
    assert model_configs.stale(tmp_path) == []
    talker = tmp_path / "talker" / "config.pbtxt"
    talker.write_text(talker.read_text().replace("dims: [ 8 ]", "dims: [ 16 ]"))
    assert model_configs.stale(tmp_path) == ["talker"]
    assert model_configs.main(["--check", "--out", str(tmp_path)]) == 1


def test_every_contract_tensor_is_in_the_configs_with_its_type():
    configs = model_configs.configs()
    for spec in contract.INPUTS:
        line = f'{{ name: "{spec.name}" data_type: {model_configs.PBTXT_TYPES[spec.datatype]} dims: [ {", ".join(map(str, spec.dims))} ]'
        assert line in configs["ensemble"] and line in configs["talker"]
    assert 'name: "AUDIO_OUT" data_type: TYPE_FP32 dims: [ 1920 ]' in configs["code2wav"]
    assert 'input_map { key: "AGENT_CODES" value: "agent_codes" }' in configs["ensemble"]


def test_an_optional_input_is_a_one_line_change(monkeypatch):
    audio_in = dataclasses.replace(contract.INPUTS[0], optional=True)
    monkeypatch.setattr(contract, "INPUTS", (audio_in, *contract.INPUTS[1:]))
    configs = model_configs.configs()
    for model in ("talker", "ensemble"):
        assert '{ name: "AUDIO_IN" data_type: TYPE_FP32 dims: [ -1 ] optional: true }' in configs[model]


def test_instances_per_gpu_or_on_the_cpu():
    every_gpu = model_configs.configs(model_configs.instances_from_args("all", 1))
    some_gpus = model_configs.configs(model_configs.instances_from_args("0,2", 1))
    cpu = model_configs.configs(model_configs.instances_from_args(None, 2))
    for model in ("talker", "code2wav"):
        assert "instance_group [ { kind: KIND_GPU count: 1 } ]" in every_gpu[model]
        assert "instance_group [ { kind: KIND_GPU count: 1 gpus: [ 0, 2 ] } ]" in some_gpus[model]
        assert "instance_group [ { kind: KIND_CPU count: 2 } ]" in cpu[model]
        # each stage keeps a conversation on one instance
        assert "sequence_batching {" in cpu[model]
    assert "instance_group" not in cpu["ensemble"]


def test_parameter_overrides():
    configs = model_configs.configs(overrides={"talker.max_conversations": "64"})
    assert '{ key: "max_conversations" value: { string_value: "64" } }' in configs["talker"]
    assert '{ key: "max_conversations" value: { string_value: "auto" } }' in configs["code2wav"]
    with pytest.raises(KeyError, match="talker.nonsense"):
        model_configs.configs(overrides={"talker.nonsense": "1"})


def test_write_elsewhere_copies_the_adapters(tmp_path):
    model_configs.main(["--out", str(tmp_path), "--gpus", "all", "--set", "code2wav.device=cuda"])
    assert (tmp_path / "talker" / "1" / "model.py").read_text() == (MODEL_REPOSITORY / "talker" / "1" / "model.py").read_text()
    assert "KIND_GPU" in (tmp_path / "code2wav" / "config.pbtxt").read_text()
    assert '{ key: "device" value: { string_value: "cuda" } }' in (tmp_path / "code2wav" / "config.pbtxt").read_text()


def test_the_sequence_batcher_holds_back_no_conversation_a_pool_could_take():
    """Past its candidates Triton keeps a sequence unanswered until one ends: there must be
    more candidates than any pool has slots (the largest: code2wav's on a GPU)."""
    import re

    from personaplex_triton.core import tunables

    for model in ("talker", "code2wav"):
        text = (MODEL_REPOSITORY / model / "config.pbtxt").read_text()
        candidates = int(re.search(r"max_candidate_sequences: (\d+)", text).group(1))
        assert candidates > tunables.GPU_DECODER_SLOTS


def test_the_one_stub_repository_serves_the_same_contract(tmp_path):
    """`speech` takes the ensemble's inputs and gives its outputs, with the talker's parameters
    and code2wav's pool; the ensemble in front of it is that one step, under the same name."""
    two, one = model_configs.configs(), model_configs.configs(one_stub=True)
    assert set(one) == {"speech", "ensemble"}
    for spec in (*contract.INPUTS, *contract.OUTPUTS):
        line = f'{{ name: "{spec.name}" data_type: {model_configs.PBTXT_TYPES[spec.datatype]} dims: [ {", ".join(map(str, spec.dims))} ]'
        assert line in one["speech"] and line in one["ensemble"]
    assert 'model_name: "speech"' in one["ensemble"] and "talker" not in one["ensemble"]
    assert one["ensemble"].split("ensemble_scheduling")[0] == two["ensemble"].split("ensemble_scheduling")[0]
    for key in ("max_conversations", "kv_dtype", "warm_personas", "send_threads", "start_piece_spacing",
                "decoder_conversations"):
        assert f'{{ key: "{key}" value:' in one["speech"]
    with pytest.raises(KeyError, match="talker.max_conversations"):  # no talker model in that repository
        model_configs.configs(overrides={"talker.max_conversations": "8"}, one_stub=True)
    model_configs.main(["--one-stub", "--out", str(tmp_path), "--set", "speech.max_conversations=64"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ensemble", "speech"]
    assert (tmp_path / "speech" / "1" / "model.py").read_text() == \
        (ONE_STUB_REPOSITORY / "speech" / "1" / "model.py").read_text()
    assert '{ key: "max_conversations" value: { string_value: "64" } }' in (tmp_path / "speech" / "config.pbtxt").read_text()
    assert model_configs.stale(tmp_path) == ["speech"]  # the override, against the defaults
