import pytest

from hf_softmax_rnn import AttentionSpec
from hf_softmax_rnn.analysis.mqar_train import mqar_accuracy, state_floats
from hf_softmax_rnn.analysis.small_models import small_llama
from hf_softmax_rnn.data.mqar import IGNORE_INDEX, MQARConfig, generate_mqar


def test_accuracy_matches_argmax_of_full_logits():
    task = MQARConfig(vocab_size=32, seq_len=16, num_kv_pairs=2)
    data = generate_mqar(10, task, seed=0).with_format("torch")[:]
    model = small_llama("softmax", vocab_size=32, hidden_size=16, num_heads=2, max_position_embeddings=16)
    predicted = model(input_ids=data["input_ids"], use_cache=False).logits.argmax(-1)  # predicts token t+1
    labels = data["labels"][:, 1:]
    scored = labels != IGNORE_INDEX
    expected = (predicted[:, :-1][scored] == labels[scored]).float().mean().item()
    assert mqar_accuracy(model, data["input_ids"], data["labels"], batch_size=3) == pytest.approx(expected)


@pytest.mark.parametrize("attention", ["linear_elu", "softmax_taylor_2"], ids=str)
def test_state_of_finite_state_specs_is_the_recurrent_state(attention):
    spec = AttentionSpec.coerce(attention)
    floats = state_floats(spec, d_model=64, num_heads=2, num_layers=2, seq_len=64)
    assert floats == 2 * 2 * spec.state_bytes(head_dim=32) // 4


def test_a_short_convolution_adds_its_last_keys_and_values_to_the_state():
    plain = state_floats(AttentionSpec.from_preset("deltanet"), d_model=64, num_heads=2, num_layers=2, seq_len=64)
    conv = state_floats(AttentionSpec.from_preset("deltanet_conv"), d_model=64, num_heads=2, num_layers=2, seq_len=64)
    assert plain == 2 * 2 * 32 * 33 and conv == plain + 2 * 2 * 3 * (32 + 32)  # width 4: 3 keys and values a head


def test_state_of_exact_exp_is_the_kv_cache():
    assert state_floats(AttentionSpec(), d_model=64, num_heads=2, num_layers=2, seq_len=64) == 2 * 2 * 64 * 64
