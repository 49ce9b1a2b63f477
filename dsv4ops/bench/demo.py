"""A small demo of the layer: random weights, every layer type, shape, time and the max difference
against the fp64 reference."""

import argparse
import time

import torch

from dsv4ops import DeepseekV4Attention, DSV4AttentionConfig, reference, testing


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m dsv4ops", description=__doc__)
    ap.add_argument("--seq", type=int, default=300, help="tokens per sequence (crosses the 128 boundary)")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    cfg = DSV4AttentionConfig.tiny()
    print(f"dsv4ops demo on {args.device}: tiny config (heads {cfg.num_heads}, head_dim {cfg.head_dim}, "
          f"window {cfg.window}, ratios {cfg.csa_ratio}/{cfg.hca_ratio}), x [{args.batch}, {args.seq}, {cfg.hidden_size}]")
    for layer_idx in range(3):
        layer = testing.randomize_(DeepseekV4Attention(cfg, layer_idx), seed=layer_idx).to(args.device)
        x = torch.randn(args.batch, args.seq, cfg.hidden_size, device=args.device)
        with torch.no_grad():
            layer(x)  # warm-up
            t0 = time.perf_counter()
            y = layer(x)
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            ms = (time.perf_counter() - t0) * 1e3
            params = {k: v.double() for k, v in layer.named_parameters()}
            ref = reference.attention(params, cfg, layer_idx, x.double())
        err = (y.double() - ref).abs().max().item()
        print(f"  layer {layer_idx} {layer.layer_type:<30} out {tuple(y.shape)}  {ms:8.2f} ms  "
              f"max|out - ref64| {err:.2e} (|ref| max {ref.abs().max().item():.2f})")


if __name__ == "__main__":
    main()
