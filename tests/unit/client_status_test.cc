// The C++ client's reading of gRPC statuses: a call that reached a server as it shut down, before
// any handler took it, is UNAVAILABLE (a miss callers retry), not gRPC's CANCELLED "CANCELLED"
// (grpc/grpc#41785): a drained replica's last calls end that way, and the routing test saw one.
#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <chrono>
#include <future>
#include <thread>

#include "client/attnd_client.h"

namespace attnd::client {
namespace {

TEST(ClientStatus, ACallPendingWhenTheServerShutsDownIsUnavailable) {
  // A server that accepts calls but hands none to a handler (an async generic service that
  // requests no call): every call stays pending until Shutdown ends it.
  grpc::AsyncGenericService generic;
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterAsyncGenericService(&generic);
  std::unique_ptr<grpc::ServerCompletionQueue> cq = builder.AddCompletionQueue();
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  const std::string target = "127.0.0.1:" + std::to_string(port);

  // What gRPC itself says to such a call (the premise), beside what the client says.
  auto raw = std::async(std::launch::async, [&] {
    auto channel = grpc::CreateChannel(target, grpc::InsecureChannelCredentials());
    grpc::GenericStub stub(channel);
    grpc::ClientContext ctx;
    grpc::Slice empty(std::string{});  // an empty ServerInfoRequest
    grpc::ByteBuffer in(&empty, 1), out;
    std::promise<grpc::Status> done;
    stub.UnaryCall(&ctx, "/attnd.v1.Attention/ServerInfo", grpc::StubOptions(), &in, &out,
                   [&done](grpc::Status s) { done.set_value(s); });
    return done.get_future().get();
  });
  auto via_client = std::async(std::launch::async, [&] {
    return Client::Connect(target)->DescribeSequence("seq").status();
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(500));  // both calls reach the server
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(200));
  cq->Shutdown();
  void* tag;
  bool ok;
  while (cq->Next(&tag, &ok)) {
  }

  const grpc::Status premise = raw.get();
  EXPECT_EQ(premise.error_code(), grpc::StatusCode::CANCELLED) << premise.error_message();
  EXPECT_EQ(premise.error_message(), "CANCELLED");
  const absl::Status s = via_client.get();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_NE(s.message().find("shut down before handling the call"), std::string::npos) << s;
}

TEST(ClientStatus, OtherStatusesKeepTheirCodeAndMessage) {
  EXPECT_TRUE(FromGrpcNotCancelled(grpc::Status::OK).ok());
  const absl::Status aborted =
      FromGrpcNotCancelled(grpc::Status(grpc::StatusCode::CANCELLED, "step aborted by AbortStep"));
  EXPECT_EQ(aborted.code(), absl::StatusCode::kCancelled);  // the server's own words: kept
  EXPECT_EQ(aborted.message(), "step aborted by AbortStep");
  const absl::Status missing =
      FromGrpcNotCancelled(grpc::Status(grpc::StatusCode::NOT_FOUND, "sequence 'x' not found"));
  EXPECT_EQ(missing.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(FromGrpc(grpc::Status(grpc::StatusCode::CANCELLED, "CANCELLED")).code(),
            absl::StatusCode::kCancelled);  // a call this client cancelled stays CANCELLED
}

}  // namespace
}  // namespace attnd::client
