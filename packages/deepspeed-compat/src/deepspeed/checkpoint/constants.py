"""``deepspeed.checkpoint.constants``: DeepSpeed's names of its checkpoint files and of the keys
inside them (the optimizer's, the module's, a universal checkpoint's). Names only: zengine reads
and writes DeepSpeed's checkpoints itself."""

__all__ = [
    "BASE_OPTIMIZER_STATE",
    "BASE_OPTIMIZER_STATE_STEP",
    "BF16_ZERO_FILE_PREFIX",
    "BUFFER_NAMES",
    "CAT_DIM",
    "CHECKPOINT_PARALLEL_DIMS",
    "CHECKPOINT_PP_DEGREE",
    "CHECKPOINT_TP_DEGREE",
    "CLIP_GRAD",
    "DS_VERSION",
    "FP16_ZERO_FILE_PREFIX",
    "FP32_FLAT_GROUPS",
    "FP32_GROUPS",
    "FP32_WEIGHT_KEY",
    "FROZEN_PARAM_FRAGMENTS",
    "FROZEN_PARAM_SHAPES",
    "GROUP_PADDINGS",
    "LAYER_FILE_PREFIX",
    "LOSS_SCALER",
    "MODEL_FILE_PREFIX",
    "MODEL_FILE_SUFFIX",
    "OPTIMIZER_STATE_DICT",
    "OPTIM_FILE_SUFFIX",
    "ORIGINAL_VOCAB_SIZE",
    "PADDED_VOCAB_SIZE",
    "PARAM",
    "PARAMETER_TO_AVERAGE_PATTERNS",
    "PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0",
    "PARAMETER_WITH_ROW_PARALLELISM_PATTERNS",
    "PARAMETER_WITH_SUB_PARAMS",
    "PARAM_ALIGNMENT_PADDINGS",
    "PARAM_GROUPS",
    "PARAM_N_SUB_PARAMS",
    "PARAM_SHAPES",
    "PARAM_SLICE_MAPPINGS",
    "PARTITION_COUNT",
    "PIPELINE_REPLICATED_PARAMETER_PATTERNS",
    "SINGLE_PARTITION_OF_FP32_GROUPS",
    "SUB_PARAMS_SHAPE",
    "SUB_PARAM_SHAPE",
    "TP_REPLICATED_PARAMETER_PATTERNS",
    "UNIVERSAL_CHECKPOINT_INFO",
    "UNIVERSAL_CHECKPOINT_VERSION_KEY",
    "UNIVERSAL_CHECKPOINT_VERSION_VALUE",
    "VOCABULARY_PARAMETER_PATTERNS",
    "VOCAB_TENSOR",
    "ZERO_FILE_PREFIX",
    "ZERO_STAGE",
]

# the optimizer's state dict
OPTIMIZER_STATE_DICT = "optimizer_state_dict"
FP32_GROUPS = "fp32_groups"
FP32_FLAT_GROUPS = "fp32_flat_groups"
BASE_OPTIMIZER_STATE = "base_optimizer_state"
BASE_OPTIMIZER_STATE_STEP = "base_optimizer_state_step"
SINGLE_PARTITION_OF_FP32_GROUPS = "single_partition_of_fp32_groups"
PARAM_GROUPS = "param_groups"
GROUP_PADDINGS = "group_paddings"
PARAM_ALIGNMENT_PADDINGS = "param_alignment_paddings"
PARTITION_COUNT = "partition_count"
ZERO_STAGE = "zero_stage"
CLIP_GRAD = "clip_grad"
FP32_WEIGHT_KEY = "fp32"
LOSS_SCALER = "loss_scaler"

# the module's state
PARAM = "param"
PARAM_SHAPES = "param_shapes"
BUFFER_NAMES = "buffer_names"
FROZEN_PARAM_SHAPES = "frozen_param_shapes"
FROZEN_PARAM_FRAGMENTS = "frozen_param_fragments"

# the files: mp_rank_00_model_states.pt, zero_pp_rank_0_mp_rank_00_optim_states.pt, layer_01-...
MODEL_FILE_PREFIX = "mp_rank_"
ZERO_FILE_PREFIX = "zero_pp_rank_"
OPTIM_FILE_SUFFIX = "_optim_states.pt"
MODEL_FILE_SUFFIX = "_model_states.pt"
LAYER_FILE_PREFIX = "layer_"
BF16_ZERO_FILE_PREFIX = "bf16_" + ZERO_FILE_PREFIX
FP16_ZERO_FILE_PREFIX = "fp16_" + ZERO_FILE_PREFIX
CHECKPOINT_PARALLEL_DIMS = "checkpoint_parallel_dimensions"
CHECKPOINT_PP_DEGREE = "pp_degree"
CHECKPOINT_TP_DEGREE = "tp_degree"
DS_VERSION = "ds_version"

# a universal checkpoint's description of the model (a model-states file's entry)
UNIVERSAL_CHECKPOINT_INFO = "universal_checkpoint_info"
UNIVERSAL_CHECKPOINT_VERSION_KEY = "universal_checkpoint_version"
UNIVERSAL_CHECKPOINT_VERSION_VALUE = 0.4
VOCAB_TENSOR = "vocab_tensor"
PADDED_VOCAB_SIZE = "padded_vocab_size"
ORIGINAL_VOCAB_SIZE = "original_vocab_size"
PARAM_SLICE_MAPPINGS = "param_slice_mappings"
CAT_DIM = "cat_dim"
PARAM_N_SUB_PARAMS = "param_n_sub_params"
SUB_PARAM_SHAPE = "sub_param_shape"
SUB_PARAMS_SHAPE = "sub_params_shape"
VOCABULARY_PARAMETER_PATTERNS = "vocabulary_parameter_patterns"
PIPELINE_REPLICATED_PARAMETER_PATTERNS = "pipeline_replicated_parameter_patterns"
PARAMETER_TO_AVERAGE_PATTERNS = "parameter_to_average_patterns"
PARAMETER_WITH_ROW_PARALLELISM_PATTERNS = "parameter_with_row_parallelism_patterns"
TP_REPLICATED_PARAMETER_PATTERNS = "tp_replicated_parameter_patterns"
PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0 = "parameter_with_2_sub_params_cat_dim_0"
PARAMETER_WITH_SUB_PARAMS = "parameter_with_sub_params"
