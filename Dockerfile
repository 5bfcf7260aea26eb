# capo's image: a static-ish release build on a minimal non-root base.
# No image can be built on the development machines of this repository (no container
# engine there); CI builds and tests the binary itself. Build elsewhere with:
#   docker build -t capo:0.1.0 .
FROM rust:1.89-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked --bin capo

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /src/target/release/capo /capo
USER 65532:65532
ENTRYPOINT ["/capo"]
