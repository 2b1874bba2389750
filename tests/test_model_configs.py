"""The model configurations are made from the wire contract and each model's config
(serving/parameters.py), and the committed ones (and the docs' parameter table) are that output."""

import dataclasses

import pytest

from personaplex_triton.core import contract, tunables
from personaplex_triton.core.paths import MODEL_REPOSITORY, ONE_STUB_REPOSITORY
from personaplex_triton.serving import model_configs
from personaplex_triton.serving.parameters import (
    CONFIGS, Code2WavConfig, ParameterError, SpeechConfig, TalkerConfig)


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
    with pytest.raises(ParameterError, match="talker: parameter max_conversations must be a whole number"):
        model_configs.configs(overrides={"talker.max_conversations": "many"})  # checked as the model reads it


def test_the_docs_table_lists_every_parameter_of_every_model():
    table = model_configs.parameter_table()
    for model, config in CONFIGS.items():
        for field in dataclasses.fields(config):
            row = next(line for line in table.splitlines() if line.startswith(f"| `{field.name}` |")
                       and model in line.split(" | ")[2].split(", "))
            assert field.metadata["help"] in row
    docs = model_configs.DOCS.read_text()
    assert model_configs.docs_with_table(docs) == docs  # the committed page is current


def test_a_models_parameters_are_read_once_into_its_typed_config():
    """Triton's `initialize(args)` parameters become the config's typed values; those left out
    keep their defaults, the same ones config.pbtxt is written with."""
    import json

    parameters = {"max_conversations": "3", "warm_personas": "NATF0, NATM0", "kv_dtype": "float8_e4m3fn",
                  "prefill_chunk_spacing": "3", "idle_timeout_s": "2.5", "stage_process": "True", "device": "cpu"}
    args = {"model_config": json.dumps({"parameters": {k: {"string_value": v} for k, v in parameters.items()}}),
            "model_instance_kind": "CPU"}
    config = TalkerConfig.from_triton(args)
    assert (config.max_conversations, config.warm_personas, config.kv_dtype) == (3, ("NATF0", "NATM0"), "float8_e4m3fn")
    assert (config.prefill_chunk_spacing, config.idle_timeout_s, config.device) == (3, 2.5, "cpu")
    # resolved for the instance: stage_process true, so send_threads auto is several
    assert config.stage_process is True and config.send_threads == tunables.STAGE_PROCESS_SEND_THREADS > 1
    assert config.persona_cache_size == 16 and config.dtype == "auto"  # the defaults
    assert TalkerConfig().warm_personas is None  # "all": every voice of the checkpoint
    assert TalkerConfig.from_parameters({"warm_personas": ""}).warm_personas == ()
    speech = SpeechConfig.from_parameters({"code2wav_conversations": "5", "mimi_runtime": "torch"})
    assert speech.code2wav() == Code2WavConfig(max_conversations=5, mimi_runtime="torch")


def test_the_weight_dtype_and_the_memory_budget_parse():
    assert (TalkerConfig().weight_dtype, TalkerConfig().gpu_memory_gib) == ("bfloat16", None)  # auto: the whole card
    config = SpeechConfig.from_parameters({"weight_dtype": "Float8_E4M3FN", "gpu_memory_gib": "15.5"})
    assert (config.weight_dtype, config.gpu_memory_gib) == ("float8_e4m3fn", 15.5)
    assert TalkerConfig.from_parameters({"gpu_memory_gib": "auto"}).gpu_memory_gib is None


def test_auto_choices_follow_the_device():
    on_cpu = Code2WavConfig(device="cpu").resolved()
    assert (on_cpu.stage_process, on_cpu.send_threads) == (False, 1)
    on_gpu = Code2WavConfig(device="cuda:1").resolved()  # resolving touches no GPU
    assert (on_gpu.stage_process, on_gpu.send_threads) == (True, tunables.STAGE_PROCESS_SEND_THREADS)
    assert Code2WavConfig(device="cuda", send_threads=2, stage_process=False).resolved().send_threads == 2
    assert on_cpu.resolved() == on_cpu  # resolving twice changes nothing


@pytest.mark.parametrize("model, key, value, message", [
    ("talker", "stage_process", "yes", 'stage_process must be "true" or "false"'),
    ("code2wav", "send_threads", "0", "send_threads must be a whole number of at least 1"),
    ("talker", "send_threads", "1.5", "send_threads must be a whole number of at least 1"),
    ("talker", "kv_dtype", "fp8", 'kv_dtype must be "auto" or "bfloat16" or "float8_e4m3fn"'),
    ("speech", "idle_timeout_s", "0", "idle_timeout_s must be more than 0 seconds"),
    ("talker", "weight_dtype", "fp8", 'weight_dtype must be "bfloat16" or "float8_e4m3fn"'),
    ("speech", "gpu_memory_gib", "0", "gpu_memory_gib must be more than 0 GiB"),
    ("talker", "gpu_memory_gib", "16GB", "gpu_memory_gib must be a number of GiB"),
    ("code2wav", "device", "gpu0", 'device must be "auto", "cpu", "cuda" or "cuda:N"'),
    ("speech", "one_tick", "false", "speech: no such parameter: one_tick"),
    ("talker", "code2wav_conversations", "4", "talker: no such parameter: code2wav_conversations"),
])
def test_a_bad_parameter_is_refused_with_its_name(model, key, value, message):
    with pytest.raises(ParameterError, match=message) as refused:
        CONFIGS[model].from_parameters({key: value})
    assert value in str(refused.value) or "no such parameter" in message


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
    for key in ("max_conversations", "kv_dtype", "warm_personas", "send_threads", "prefill_chunk_spacing",
                "code2wav_conversations"):
        assert f'{{ key: "{key}" value:' in one["speech"]
    with pytest.raises(KeyError, match="talker.max_conversations"):  # no talker model in that repository
        model_configs.configs(overrides={"talker.max_conversations": "8"}, one_stub=True)
    model_configs.main(["--one-stub", "--out", str(tmp_path), "--set", "speech.max_conversations=64"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ensemble", "speech"]
    assert (tmp_path / "speech" / "1" / "model.py").read_text() == \
        (ONE_STUB_REPOSITORY / "speech" / "1" / "model.py").read_text()
    assert '{ key: "max_conversations" value: { string_value: "64" } }' in (tmp_path / "speech" / "config.pbtxt").read_text()
    assert model_configs.stale(tmp_path) == ["speech"]  # the override, against the defaults
