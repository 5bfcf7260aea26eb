# capo's image: a static-ish release build on a minimal non-root base.
# Build with a container engine:
#   docker build -t capo:0.1.0 .
# or without one, from the same recipe (Debian's C runtime, user 65532): `make image`
# (hack/build-image.sh), which the tests run on a real node.
FROM rust:1.89-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked --bin capo

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /src/target/release/capo /capo
USER 65532:65532
ENTRYPOINT ["/capo"]
