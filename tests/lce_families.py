"""Tiny random Hugging Face models of many families (offline, fp32, eager attention), for the
linear_cross_entropy head tests: each entry builds a model whose head is a vocabulary projection
followed by transformers' ForCausalLMLoss, in one of the forward patterns the feature reads.

FAMILIES: name -> (builder, expected op options {"temperature": t, "softcap": c}).
Vision-language models reserve the top vocabulary ids for their special tokens: text batches use
ids below ``V - 8``; ``image_batch(name)`` adds an image where the family has one here.
"""
import torch

V = 160  # vocabulary (the top 8 ids: image/video special tokens of the VLMs)
TEXT_IDS = V - 8
_TXT = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, head_dim=8)
_MAMBA = dict(mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_chunk_size=8)


def _eager(cfg):
    cfg._attn_implementation = "eager"
    for sub in ("text_config", "vision_config"):
        if getattr(cfg, sub, None) is not None:
            getattr(cfg, sub)._attn_implementation = "eager"
    return cfg


def _build(cfg_name, model_name=None, **kw):
    import transformers

    def make(seed=0, **over):
        cfg = _eager(getattr(transformers, cfg_name)(**{**kw, **over}))
        torch.manual_seed(seed)
        if model_name is None:
            return transformers.AutoModelForCausalLM.from_config(cfg).float()
        return getattr(transformers, model_name)(cfg).float()

    return make


_QWEN_ROPE = {"type": "mrope", "mrope_section": [1, 1, 2]}
_QWEN_IDS = dict(image_token_id=V - 1, video_token_id=V - 2, vision_start_token_id=V - 3)

FAMILIES = {
    # heads not named *ForCausalLM, logits used after the loss only in code the fused path skips
    "gpt2": (_build("GPT2Config", n_embd=32, n_layer=1, n_head=4, vocab_size=V, n_positions=64), {}),
    "openai-gpt": (_build("OpenAIGPTConfig", vocab_size=V, n_embd=32, n_layer=1, n_head=4, n_positions=64), {}),
    "ctrl": (_build("CTRLConfig", vocab_size=V, n_embd=32, n_layer=1, n_head=4, n_positions=64, dff=64), {}),
    "opt": (_build("OPTConfig", vocab_size=V, hidden_size=32, num_hidden_layers=1, ffn_dim=64, num_attention_heads=4,
                   max_position_embeddings=64, word_embed_proj_dim=32), {}),  # self.lm_head(h).contiguous()
    "bloom": (_build("BloomConfig", vocab_size=V, hidden_size=32, n_layer=1, n_head=4), {}),
    "mpt": (_build("MptConfig", vocab_size=V, d_model=32, n_heads=4, n_layers=1, max_seq_len=64), {}),
    "xglm": (_build("XGLMConfig", vocab_size=V, d_model=32, ffn_dim=64, num_layers=1, attention_heads=4,
                    max_position_embeddings=64), {}),
    "falcon": (_build("FalconConfig", vocab_size=V, hidden_size=32, num_hidden_layers=1, num_attention_heads=4), {}),
    "gpt-neo": (_build("GPTNeoConfig", vocab_size=V, hidden_size=32, num_layers=1, num_heads=4,
                       attention_types=[[["global"], 1]], max_position_embeddings=64), {}),
    # heads under other names
    "biogpt": (_build("BioGptConfig", vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4), {}),  # self.output_projection
    "gpt-neox-japanese": (_build("GPTNeoXJapaneseConfig", vocab_size=V, hidden_size=32, num_hidden_layers=1,
                                 num_attention_heads=4, intermediate_multiple_size=2), {}),  # self.embed_out
    "rwkv": (_build("RwkvConfig", vocab_size=V, hidden_size=32, num_hidden_layers=2, attention_hidden_size=32,
                    intermediate_size=64, context_length=64), {}),  # self.head
    "modernbert-decoder": (_build("ModernBertDecoderConfig", pad_token_id=0, vocab_size=V, hidden_size=32,
                                  intermediate_size=64, num_hidden_layers=1, num_attention_heads=4),
                           {}),  # self.decoder(self.lm_head(h)): the projection is self.decoder
    "mamba": (_build("MambaConfig", vocab_size=V, hidden_size=32, num_hidden_layers=1, state_size=8),
              {}),  # self.lm_head(h.to(self.lm_head.weight.dtype)).float()
    "nemotron-h": (_build("NemotronHConfig", vocab_size=V, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=8, layers_block_type=["attention", "mlp"],
                          mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=8, n_groups=1, chunk_size=8), {}),
    "mllama-text": (_build("MllamaTextConfig", "MllamaForCausalLM", pad_token_id=0, vocab_size=V, hidden_size=32,
                           intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                           cross_attention_layers=[]), {}),
    # scalar multiplies and divisions: the op's temperature
    "cohere": (_build("CohereConfig", **_TXT, logit_scale=0.5), {"temperature": 2.0}),
    "cohere2": (_build("Cohere2Config", **_TXT, logit_scale=0.5), {"temperature": 2.0}),
    "granite": (_build("GraniteConfig", **_TXT, logits_scaling=4.0), {"temperature": 4.0}),
    "granitemoe": (_build("GraniteMoeConfig", **_TXT, logits_scaling=4.0, num_local_experts=4, num_experts_per_tok=2),
                   {"temperature": 4.0}),
    "granitemoehybrid": (_build("GraniteMoeHybridConfig", **_TXT, logits_scaling=4.0, num_local_experts=4,
                                num_experts_per_tok=2, layer_types=["attention"], **_MAMBA), {"temperature": 4.0}),
    "jetmoe": (_build("JetMoeConfig", vocab_size=V, hidden_size=32, num_hidden_layers=1, num_key_value_heads=2,
                      kv_channels=8, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2), {}),
    "hyperclovax": (_build("HyperCLOVAXConfig", **_TXT, logits_scaling=0.25), {"temperature": 4.0}),
    "falcon-h1": (_build("FalconH1Config", **_TXT, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_d_state=8,
                         mamba_chunk_size=8, lm_head_multiplier=0.5), {"temperature": 2.0}),  # self.model.x
    "bamba": (_build("BambaConfig", **_TXT, attn_layer_indices=[0], **_MAMBA), {}),  # z-loss block: coefficient 0
    # final soft caps: the op's softcap
    "gemma": (_build("GemmaConfig", **_TXT), {}),
    "gemma2": (_build("Gemma2Config", **_TXT, final_logit_softcapping=3.0), {"softcap": 3.0}),
    "gemma3-text": (_build("Gemma3TextConfig", **_TXT, final_logit_softcapping=3.0), {"softcap": 3.0}),
    "gemma3n-text": (_build("Gemma3nTextConfig", "Gemma3nForCausalLM",
                            **{**_TXT, "num_hidden_layers": 2, "intermediate_size": [64, 64]},
                            final_logit_softcapping=3.0, laurel_rank=4,
                            altup_num_inputs=2, hidden_size_per_layer_input=8, vocab_size_per_layer_input=V,
                            num_kv_shared_layers=0, layer_types=["sliding_attention", "full_attention"],
                            activation_sparsity_pattern=[0.0, 0.0], sliding_window=16), {"softcap": 3.0}),
    "gemma4-text": (_build("Gemma4TextConfig", "Gemma4ForCausalLM", **{**_TXT, "num_hidden_layers": 2},
                           final_logit_softcapping=3.0), {"softcap": 3.0}),
    "vaultgemma": (_build("VaultGemmaConfig", **_TXT, final_logit_softcapping=3.0), {"softcap": 3.0}),
    "recurrent-gemma": (_build("RecurrentGemmaConfig", vocab_size=V, hidden_size=32, intermediate_size=64,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, lru_width=32,
                               logits_soft_cap=5.0, block_types=["recurrent", "attention"],
                               attention_window_size=16), {"softcap": 5.0}),  # tanh(logits / cap) * cap
    # vision-language models: the language model's head under the multimodal wrapper
    "qwen2-vl": (_build("Qwen2VLConfig", "Qwen2VLForConditionalGeneration",
                        text_config=dict(**_TXT, rope_scaling=_QWEN_ROPE),
                        vision_config=dict(depth=1, embed_dim=32, hidden_size=32, num_heads=4, mlp_ratio=2,
                                           patch_size=2, temporal_patch_size=1, spatial_merge_size=1),
                        **_QWEN_IDS), {}),
    "qwen2.5-vl": (_build("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration",
                          text_config=dict(**_TXT, rope_scaling=_QWEN_ROPE),
                          vision_config=dict(depth=1, hidden_size=32, num_heads=4, intermediate_size=64, patch_size=2,
                                             temporal_patch_size=1, spatial_merge_size=1, out_hidden_size=32,
                                             window_size=4, fullatt_block_indexes=[0]),
                          **_QWEN_IDS), {}),
    "qwen3-vl": (_build("Qwen3VLConfig", "Qwen3VLForConditionalGeneration",
                        text_config=dict(**_TXT, rope_scaling={"rope_type": "default", "mrope_section": [1, 1, 2],
                                                               "mrope_interleaved": True}),
                        vision_config=dict(depth=1, hidden_size=32, num_heads=4, intermediate_size=64, patch_size=2,
                                           temporal_patch_size=1, spatial_merge_size=1, out_hidden_size=32,
                                           num_position_embeddings=16, deepstack_visual_indexes=[]),
                        **_QWEN_IDS), {}),
    "llava": (_build("LlavaConfig", "LlavaForConditionalGeneration", text_config=dict(model_type="llama", **_TXT),
                     vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=1, num_attention_heads=4, image_size=8, patch_size=2,
                                        projection_dim=32),
                     image_token_id=V - 1), {}),
    "mistral3": (_build("Mistral3Config", "Mistral3ForConditionalGeneration",
                        text_config=dict(model_type="mistral", **_TXT),
                        vision_config=dict(model_type="pixtral", hidden_size=32, intermediate_size=64,
                                           num_hidden_layers=1, num_attention_heads=4, image_size=8, patch_size=2,
                                           head_dim=8),
                        image_token_id=V - 1, spatial_merge_size=1), {}),
    "cohere2-vision": (_build("Cohere2VisionConfig", "Cohere2VisionForConditionalGeneration",
                              text_config=dict(model_type="cohere2", **_TXT, logit_scale=0.5),
                              vision_config=dict(model_type="siglip_vision_model", hidden_size=32,
                                                 intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                                 image_size=8, patch_size=2),
                              image_token_id=V - 1, downsample_factor=1, alignment_intermediate_size=32),
                       {}),  # its multimodal forward does not apply the text model's logit_scale
    # Gemma 3's multimodal forward applies no final soft cap (its causal LM does): neither does the op
    "gemma3": (_build("Gemma3Config", "Gemma3ForConditionalGeneration",
                      text_config=dict(**_TXT, final_logit_softcapping=3.0),
                      vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, image_size=8, patch_size=2),
                      mm_tokens_per_image=4, image_token_id=V - 1, boi_token_index=V - 2, eoi_token_index=V - 3), {}),
    "paligemma": (_build("PaliGemmaConfig", "PaliGemmaForConditionalGeneration",
                         text_config=dict(model_type="gemma2", **_TXT, final_logit_softcapping=3.0),
                         vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                            num_attention_heads=4, image_size=8, patch_size=2, projection_dim=32),
                         image_token_id=V - 1, projection_dim=32), {"softcap": 3.0}),
}


def text_batch(seed=0, B=2, T=8):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, TEXT_IDS, (B, T), generator=g)
    labels = ids.clone()
    labels[0, :2] = -100  # a prompt that is not trained on
    mask = torch.ones(B, T, dtype=torch.long)
    mask[-1, -2:] = 0  # right padding
    labels[-1, -2:] = -100
    return dict(input_ids=ids, attention_mask=mask, labels=labels)


def image_batch(name, seed=0):
    """A batch with one image per sequence, for the VLMs that take one here (None otherwise)."""
    g = torch.Generator().manual_seed(seed + 1)
    if name == "llava":  # 8x8 image, 2x2 patches, CLS dropped: 16 image tokens
        b = text_batch(seed, T=24)
        b["input_ids"][:, 2:18] = V - 1
        b["labels"][:, 2:18] = -100
        b["pixel_values"] = torch.randn(2, 3, 8, 8, generator=g)
        return b
    if name == "qwen2.5-vl":  # a 2x2 grid of patches (no merge): 4 image tokens after vision_start
        b = text_batch(seed, T=16)
        b["input_ids"][:, 1] = V - 3
        b["input_ids"][:, 2:6] = V - 1
        b["labels"][:, 1:6] = -100
        b["pixel_values"] = torch.randn(2 * 4, 3 * 2 * 2, generator=g)
        b["image_grid_thw"] = torch.tensor([[1, 2, 2], [1, 2, 2]])
        return b
    return None
