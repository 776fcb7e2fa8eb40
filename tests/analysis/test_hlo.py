"""hlo.summarize on small hand-written HLO: loop trip counts (with the step a compiler unrolls by), async collectives
counted once with their output's bytes, the TPU compiler's fused reduce-scatter and matmul rings, custom kernels."""

from llama_jax.analysis import hlo

HLO = """HloModule jit_step

%cond (p: (s32[], f32[8])) -> pred[] {
  %p = (s32[], f32[8]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%all-reduce-scatter.1 (x: bf16[64,4]) -> bf16[16,4] {
  %x = bf16[64,4]{1,0} parameter(0)
  %all-reduce.2 = bf16[64,4]{1,0} all-reduce(%x), replica_groups={{0,1,2,3}}, to_apply=%add
  ROOT %ds = bf16[16,4]{1,0} dynamic-slice(%all-reduce.2), dynamic_slice_sizes={16,4}
}

%windowed_dot_general_body_ag.3 (q: (bf16[8,8], u32[])) -> (bf16[8,8], u32[]) {
  %q = (bf16[8,8], u32[]) parameter(0)
  %j = u32[] get-tuple-element(%q), index=1
  %w = bf16[8,8]{1,0} get-tuple-element(%q), index=0
  %cp-start = (bf16[8,8]{1,0}, bf16[8,8]{1,0}, u32[], u32[]) collective-permute-start(%w), source_target_pairs={{0,1}}
  %cp-done = bf16[8,8]{1,0} collective-permute-done(%cp-start)
  %two = u32[] constant(2)
  %next = u32[] add(%j, %two)
  ROOT %t = (bf16[8,8], u32[]) tuple(%cp-done, %next)
}

%windowed_dot_general_cond_ag.3 (q: (bf16[8,8], u32[])) -> pred[] {
  %q = (bf16[8,8], u32[]) parameter(0)
  %j = u32[] get-tuple-element(%q), index=1
  %eight = u32[] constant(8)
  ROOT %lt = pred[] compare(%j, %eight), direction=LT
}

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %v = f32[8]{0} get-tuple-element(%p), index=1
  %ag-start = ((f32[8]{0}), f32[32]{0}) all-gather-start(%v), dimensions={0}
  %ag-done = f32[32]{0} all-gather-done(%ag-start)
  %rs = bf16[16,4]{1,0} fusion(%ag-done), kind=kCustom, calls=%all-reduce-scatter.1
  %ring = (bf16[8,8], u32[]) while(%x), condition=%windowed_dot_general_cond_ag.3, body=%windowed_dot_general_body_ag.3
  %splash_mqa_fwd.7 = (f32[2,2]{1,0}) custom-call(%v), custom_call_target="tpu_custom_call", backend_config={"a":
"multi-line metadata"}
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[8]) tuple(%next, %v)
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %loop = (s32[], f32[8]) while(%init), condition=%cond, body=%body
  %ata = f32[4,8]{1,0} all-to-all(%a), dimensions={0}
  ROOT %r = f32[8]{0} get-tuple-element(%loop), index=1
}
"""


def test_collectives_are_counted_per_step_through_loops():
  summary = hlo.summarize(HLO)
  c = summary.collectives
  assert (c["all-gather"].count, c["all-gather"].bytes) == (4, 4 * 32 * 4)  # 4 iterations, the -done's f32[32]
  assert (c["reduce-scatter"].count, c["reduce-scatter"].bytes) == (4, 4 * 64 * 4 * 2)  # the fused all-reduce
  assert c["all-reduce"].count == 0
  # The ring: 8 / step 2 = 4 iterations per layer iteration, 4 layer iterations.
  assert (c["all-gather in matmul"].count, c["all-gather in matmul"].bytes) == (16, 16 * 8 * 8 * 2)
  assert c["collective-permute"].count == 0
  assert (c["all-to-all"].count, c["all-to-all"].bytes) == (1, 4 * 8 * 4)
  assert summary.kernels == {"splash_mqa_fwd": 4}


def test_shape_bytes_of_arrays_and_tuples():
  assert hlo.shape_bytes("bf16[2,64]{1,0:T(8,128)(2,1)}") == 256
  assert hlo.shape_bytes("(f32[3], s8[1,2,2], pred[])") == 12 + 4 + 1


def test_collective_shapes_names_each_instruction_s_array_without_its_layout():
  """Instructions, not executions: the loop's all-gather once, its fused reduce-scatter as a reduce-scatter of the
  array the fusion's all-reduce produces, the matmul ring's permute as the all-gather it is."""
  assert hlo.collective_shapes(HLO) == {
    ("reduce-scatter", "bf16[64,4]"): 1,
    ("all-gather in matmul", "bf16[8,8]"): 1,
    ("all-gather", "f32[32]"): 1,
    ("all-to-all", "f32[4,8]"): 1,
  }
